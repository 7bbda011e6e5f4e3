"""Example and default policies, shipped with the package (the default one is embedded in `run`)."""
