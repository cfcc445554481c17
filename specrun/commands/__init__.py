"""One module per CLI command: what it does, as plain functions (cli.py parses options and calls one)."""
