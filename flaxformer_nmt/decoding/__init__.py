"""Search (beam, greedy, sampling), the Translator, MBR, reranking, generation and fill-mask."""
