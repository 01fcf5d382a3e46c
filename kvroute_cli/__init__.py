"""The ``kvroute`` command line."""
