"""The Gaudi (HPU) backend package.

Nothing in this package may import `habana_frameworks` at import time: its modules are imported and
tested on CPU, and only code that runs on a Gaudi reaches for the Habana bridge, lazily.
"""
