"""`dflash completion bash|zsh`: the shell completion script for the `dflash` command (the front
door's floor: it reads the command table).

    eval "$(dflash completion bash)"      # in ~/.bashrc
    eval "$(dflash completion zsh)"       # in ~/.zshrc (bash completion through bashcompinit)

The first word completes to a command; after a Hydra command (train, eval, regen, prep) every
word goes to Hydra's own completion of that command (`-sc query=bash`: config groups and their
options, keys and their values, as `dflash-train` completes them), with the line rewritten so that
Hydra reads `dflash-COMMAND ARGS`, the one-word program name its query strips. The other commands
complete file names. Hydra's own `--shell-completion install=bash` registers one program name, so
it cannot complete the two-word `dflash train`.
"""

from __future__ import annotations

import argparse

from dflash.cli import COMMANDS, HYDRA_COMMANDS

_BASH = """\
_dflash_complete()
{{
    local words=($COMP_LINE)
    local current="${{words[$COMP_CWORD]}}"
    if (( COMP_CWORD <= 1 )); then
        COMPREPLY=($(compgen -W "{commands} --help --version" -- "$current"))
        return
    fi
    case "${{words[1]}}" in
        {hydra})
            local rest="${{COMP_LINE#*${{words[1]}}}}"
            local line="dflash-${{words[1]}}$rest"
            local choices
            choices=$(COMP_LINE="$line" COMP_POINT=${{#line}} dflash "${{words[1]}}" -sc query=bash 2>/dev/null)
            COMPREPLY=($(compgen -o nospace -o default -W "$choices" -- "$current"))
            ;;
        *)
            COMPREPLY=($(compgen -o default -- "$current"))
            ;;
    esac
}}
COMP_WORDBREAKS=${{COMP_WORDBREAKS//=}}
complete -o nospace -o default -F _dflash_complete dflash
"""

_ZSH_PREAMBLE = "autoload -U +X bashcompinit && bashcompinit\n"


def script(shell: str) -> str:
    """The completion script for `shell` (bash, or zsh through its bash compatibility)."""
    body = _BASH.format(commands=" ".join(COMMANDS), hydra="|".join(HYDRA_COMMANDS))
    return _ZSH_PREAMBLE + body if shell == "zsh" else body


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="dflash completion",
        description='Print the shell completion script of `dflash`: eval "$(dflash completion bash)".',
    )
    parser.add_argument("shell", choices=("bash", "zsh"))
    print(script(parser.parse_args().shell), end="")


if __name__ == "__main__":
    main()
