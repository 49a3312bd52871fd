"""The language model side of a bundle: its export, FastV inside it, and what runs it."""
