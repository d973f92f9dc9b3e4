"""`finetune preflight`: pure checks of what was read from a cluster (checks.py) and the command (cli.py)."""
