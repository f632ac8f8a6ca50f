"""`dflash completion bash|zsh`: the shell completion script for the `dflash` command (the front
door's floor: it reads the command table).

    eval "$(dflash completion bash)"      # in ~/.bashrc
    eval "$(dflash completion zsh)"       # in ~/.zshrc (bash completion through bashcompinit)

The first word completes to a command; after a Hydra command (train, eval, regen, prep) every
word goes to Hydra's own completion of that command (`-sc query=bash`: config groups and their
options, keys and their values, as `dflash-train` completes them), with the line rewritten so that
Hydra reads `dflash-COMMAND ARGS`, the one-word program name its query strips. A command with
subcommands (`dflash export check|convert`) completes them next; other words complete file names.
Hydra's own `--shell-completion install=bash` registers one program name, so it cannot complete
the two-word `dflash train`.

The script leaves the shell's COMP_WORDBREAKS as it is (Hydra's own script removes `=` from it,
for every command of the shell): it splits the line at blanks itself, so `key=value` is one word,
and hands bash only the part of each reply that follows the word's last break character, the part
bash replaces.
"""

from __future__ import annotations

import argparse

from dflash.cli import COMMANDS, HYDRA_COMMANDS

# The commands whose first argument is one of a fixed set (tests/test_cli.py holds these to each
# command's own parser, which is not imported here: completing loads no torch).
SUBCOMMANDS: dict[str, tuple[str, ...]] = {
    "export": ("check", "convert"),
    "completion": ("bash", "zsh"),
}

_BASH = """\
_dflash_complete()
{{
    # zsh (bashcompinit) runs this body too: as ksh does, arrays from 0 and words split at blanks.
    if [[ -n "${{ZSH_VERSION-}}" ]]; then emulate -L ksh; else local -; fi
    set -f  # the options are the function's own: the line's words are split, never globbed
    local line="${{COMP_LINE:0:$COMP_POINT}}" current="" query choices prefix="" i
    local -a words replies
    words=($line)
    replies=()
    if [[ -n "$line" && "$line" != *[[:space:]] ]]; then
        current="${{words[${{#words[@]}}-1]}}"
        words=("${{words[@]:0:${{#words[@]}}-1}}")
    fi
    if (( ${{#words[@]}} <= 1 )); then
        replies=($(compgen -W "{commands} --help --version" -- "$current"))
    else
        case "${{words[1]}}" in
            {hydra})
                query="dflash-${{words[1]}}${{line#*"${{words[1]}}"}}"
                choices=$(COMP_LINE="$query" COMP_POINT=${{#query}} dflash "${{words[1]}}" -sc query=bash 2>/dev/null)
                replies=($(compgen -W "$choices" -- "$current"))
                ;;
{subcommands}
        esac
    fi
    # Bash replaces the part of the word after its last COMP_WORDBREAKS character (`=` and `:`
    # by default), so each reply starts there.
    for (( i = ${{#current}} - 1; i >= 0; i-- )); do
        if [[ "${{COMP_WORDBREAKS-}}" == *"${{current:$i:1}}"* ]]; then
            prefix="${{current:0:$((i + 1))}}"
            break
        fi
    done
    COMPREPLY=("${{replies[@]#"$prefix"}}")
    # No blank after `group=` or `dir/`: the word goes on.
    if [[ " ${{COMPREPLY[*]}}" == *[=/]" "* || "${{COMPREPLY[*]}}" == *[=/] ]]; then
        compopt -o nospace 2>/dev/null
    fi
}}
complete -o default -F _dflash_complete dflash
"""

# An empty reply leaves the word to the shell's own file-name completion (`complete -o default`).
_SUBCOMMAND_CASE = """\
            {name})
                if (( ${{#words[@]}} == 2 )); then
                    replies=($(compgen -W "{choices}" -- "$current"))
                fi
                ;;"""

# bashcompinit's `complete` registers through compinit's compdef, which a bare zsh lacks.
_ZSH_PREAMBLE = (
    "(( ${+functions[compdef]} )) || { autoload -U +X compinit && compinit; }\n"
    "autoload -U +X bashcompinit && bashcompinit\n"
)


def script(shell: str) -> str:
    """The completion script for `shell` (bash, or zsh through its bash compatibility)."""
    cases = "\n".join(
        _SUBCOMMAND_CASE.format(name=name, choices=" ".join(choices)) for name, choices in SUBCOMMANDS.items()
    )
    body = _BASH.format(commands=" ".join(COMMANDS), hydra="|".join(HYDRA_COMMANDS), subcommands=cases)
    return _ZSH_PREAMBLE + body if shell == "zsh" else body


def parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="dflash completion",
        description='Print the shell completion script of `dflash`: eval "$(dflash completion bash)".',
    )
    parser.add_argument("shell", choices=SUBCOMMANDS["completion"])
    return parser


def main() -> None:
    print(script(parser().parse_args().shell), end="")


if __name__ == "__main__":
    main()
