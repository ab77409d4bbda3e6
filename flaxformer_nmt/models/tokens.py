"""The reserved token ids every model and vocabulary of this project share (data/tokenizer.py trains
sentencepiece with them):
  0 = <pad>  (padding; never a training target, never generated)
  1 = <unk>
  2 = <s>    (BOS: the first decoder input)
  3 = </s>   (EOS: appended to every source and target sentence)
and the piece the masked LM writes for a masked token."""

PAD_ID, UNK_ID, BOS_ID, EOS_ID = 0, 1, 2, 3
MASK_PIECE = '<mask>'
