"""The daemon's web console (see ``app``)."""
