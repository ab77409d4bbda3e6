"""BLEU, checkpoint comparison and attention maps."""
