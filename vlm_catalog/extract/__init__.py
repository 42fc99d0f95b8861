"""Catalogue extraction from the command line: records in, predictions (JSONL) out."""
