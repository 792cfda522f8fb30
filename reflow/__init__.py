"""reflow: the project package — settings, command line, process supervisor and generated stubs."""
