"""The 3D-HybridEngine: layout arithmetic and the train -> generate resharding."""
