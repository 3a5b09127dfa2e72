"""The config tree's sections (the tree itself: launch/config/tree.py): the machinery, and model, data, engine, optim
and ipc."""
