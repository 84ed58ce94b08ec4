"""One module per subcommand, each a `main(argv)` that raises ConfigError for what a user can fix;
cli.py parses, dispatches and owns the one error guard.
"""
