"""An encoder-only masked language model (BERT-style, config.task=mlm) on the German side of Multi30k, sized
like configs/multi30k.py's encoder: 3 layers, d_model 256, 4 heads, an 8k sentencepiece vocabulary with a
<mask> piece. BERT's masking (15% of the tokens; 80% <mask>, 10% random, 10% unchanged); validation reports
masked-token accuracy and perplexity on valid.de. About 20 minutes on two CPU cores. Fill masks with
`python -m flaxformer_nmt.fill_mask --workdir W "Ein Mann <mask> ein Pferd ."`.
"""
import importlib.util
import pathlib

# The same data, vocabulary, size and schedule as the LM config beside this file; only the stack differs.
_spec = importlib.util.spec_from_file_location('lm_multi30k', pathlib.Path(__file__).with_name('lm_multi30k.py'))
_lm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(_lm)


def get_config():
  c = _lm.get_config()
  c.task = 'mlm'
  c.model.num_encoder_layers = 3
  c.model.num_decoder_layers = 0
  c.label_smoothing = 0.0  # BERT's loss: plain cross entropy on the masked positions
  return c
