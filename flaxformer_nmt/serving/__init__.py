"""Export (CTranslate2) and serving."""
