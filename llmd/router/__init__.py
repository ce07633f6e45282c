"""The llm-d style router: a pure scheduling pipeline (`llmd.router.scheduling`) behind an async HTTP proxy."""
