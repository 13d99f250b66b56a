"""``python -m compactor`` and the ``compactor`` console script.

The entry point imports the command line inside itself, so a Ctrl-C while the modules load
(the first half second of every command) ends the command as a Ctrl-C later does: exit code
130 and no traceback.
"""

from __future__ import annotations


def main() -> None:
    """Console-script entry point."""
    try:
        from compactor.cli import main as run

        run()
    except KeyboardInterrupt:  # (before a command took over Ctrl-C: most often while importing)
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
