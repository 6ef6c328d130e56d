"""ctl's commands, one module per group; ctl.cli assembles them into the `ctl` command."""
