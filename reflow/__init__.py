"""reflow: the core every package shares (settings, errors, serving, the store, the registry, the
Python client, generated stubs), and the command line on top of everything."""
