"""`python -m dflash COMMAND ...`: the same as the `dflash` command."""

from dflash.cli import main

main()
