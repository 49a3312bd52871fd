"""The graph reading every pass shares: reachability and fresh constants (dataflow), the tower's
structure (structure). Below the methods, which find their sites with it."""
