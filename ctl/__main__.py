"""`python -m ctl` = `ctl`."""

from ctl.cli import main

main()
