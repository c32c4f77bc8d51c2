"""Tools that build and check what ships; none of it is needed at run time."""
