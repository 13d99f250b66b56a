"""``python -m compactor`` runs the command line."""

from compactor.cli import main

if __name__ == "__main__":
    main()
