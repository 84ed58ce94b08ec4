"""`python -m shardtrain <command>`, and the `shardtrain` console script (entry)."""

from shardtrain.runtime.process_exit import end_without_teardown_at_exit, exit_with


def entry() -> None:
    end_without_teardown_at_exit()  # first: it runs after every exit handler registered later
    from shardtrain.cli import main

    exit_with(main())


if __name__ == "__main__":
    entry()
