"""plait's command line: ``plait <command> ...``."""
