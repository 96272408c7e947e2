"""Prompt data: generated tasks, the user's files (verl's Parquet layout), and packing rows into micro-batches."""
