"""``python -m torchneuron ...``: the ``torchneuron`` command (see ``torchneuron.cli``)."""
import sys

from torchneuron.cli import main

sys.exit(main())
