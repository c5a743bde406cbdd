"""Developer tools that are not part of the notebook API (the headless demo)."""
