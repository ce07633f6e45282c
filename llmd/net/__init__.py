"""Generic network plumbing shared by the router, the load generator and the engines' clients (no llmd imports)."""
