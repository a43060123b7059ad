"""A reward module that fails while it is imported: the worker must say so in one line."""

raise RuntimeError("this reward module is broken")
