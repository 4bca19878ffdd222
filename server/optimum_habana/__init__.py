"""The optimum-habana fallback engine: architectures with no native tgserve implementation served
on a Gaudi through optimum-habana's static-cache models, behind the `Engine` interface.

Nothing in this package may import `habana_frameworks` or `optimum` at import time: its modules are
imported and tested on CPU, and only code that runs on a Gaudi reaches for them, lazily."""
