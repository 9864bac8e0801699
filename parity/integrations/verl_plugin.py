"""parity's entry in verl's plugin group (`verl.plugins`, pyproject.toml): `import verl` loads
every plugin, and loading this one installs parity's figures in verl's trainer
(parity/integrations/verl.py). Its import is the installation, as verl's plugin contract has it;
every other module of parity changes nothing when imported."""

import sys

from parity.integrations.verl import install

install(getattr(sys.modules.get("verl"), "__version__", None) or __import__("verl").__version__)
