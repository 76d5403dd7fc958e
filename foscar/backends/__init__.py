"""Launchers: validate kernel-specific constraints, allocate/cache workspaces, compute grids."""
