"""Dataset transformations: one op per module, each a Node (recipe) and an Iter (resumable iterator)."""
