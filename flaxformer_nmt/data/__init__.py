"""Text, tokenizer, corpora, downloads and the batches that feed training."""
