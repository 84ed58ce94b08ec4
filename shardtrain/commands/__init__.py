"""One module per subcommand; cli.py parses, dispatches and owns the one error guard."""
