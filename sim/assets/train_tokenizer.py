"""Builds assets/tokenizer.json, the byte-level BPE tokenizer llmgw-sim ships.

Run once with the `tokenizers` package from PyPI (any 0.2x release):
    python train_tokenizer.py /usr/share/common-licenses/* > /dev/null
Deterministic for a given corpus and tokenizers release; the committed file is what the simulator
and its tests use, so rebuilding is never needed.
"""
import sys

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SPECIAL = ["<unk>", "<|bos|>", "<|eos|>", "<|start|>", "<|end|>"]

tok = Tokenizer(models.BPE(unk_token=None, byte_fallback=False))
tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
tok.decoder = decoders.ByteLevel()
trainer = trainers.BpeTrainer(
    vocab_size=4096,
    min_frequency=2,
    special_tokens=SPECIAL,
    initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    show_progress=False,
)
tok.train(sys.argv[1:], trainer)
tok.post_processor = processors.TemplateProcessing(
    single="<|bos|> $A",
    pair="<|bos|> $A <|bos|> $B",
    special_tokens=[("<|bos|>", tok.token_to_id("<|bos|>"))],
)
tok.save("tokenizer.json", pretty=False)
print(tok.get_vocab_size())
