"""`python -m specserve_client.fuzz`: runs the command (`specserve_client.fuzz.cli.main`) and exits with
its status; it holds nothing else."""

import sys

from specserve_client.fuzz.cli import main

if __name__ == "__main__":
    sys.exit(main())
