"""The paper's Transformer and the language-model heads built from its blocks."""
