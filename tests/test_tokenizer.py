import pickle

import pytest
import torch
from transformers import CLIPTokenizer

from models.engine.tokenizer import MAX_LENGTH, build_tokenizer, tokenize


@pytest.mark.heavy
def test_offline_clip_tokenizer_matches_open_clip():
    from open_clip.tokenizer import SimpleTokenizer

    tok = build_tokenizer()
    assert len(tok) == 49408
    assert tok("a photo of a cat").input_ids == [49406, 320, 1125, 539, 320, 2368, 49407]
    # No "!" here: as in diffusers' SD2 tokenizer, the pad token "!" is a special token, so a
    # literal "!" in a caption encodes as id 0 rather than open_clip's "!</w>" (256).
    text = "An astronaut riding a horse, 35mm photograph, golden hour."
    reference = SimpleTokenizer()
    assert tok(text).input_ids == [reference.sot_token_id, *reference.encode(text), reference.eot_token_id]


def test_sd2_padding_and_truncation():
    tok = build_tokenizer()
    ids = tokenize(tok, ["a red circle", "word " * 200])
    assert ids.shape == (2, MAX_LENGTH)
    assert ids[0, :5].tolist() == [49406, 320, 736, 7117, 49407]
    assert ids[0, 5:].eq(0).all()  # SD2 pads with "!" (id 0), like open_clip
    assert ids[1, -1].item() == 49407  # a long caption is cut, keeping the end token


def varied_captions(n: int = 400, seed: int = 0) -> list[str]:
    """LAION-like captions and what breaks tokenizers: curly quotes, HTML entities, full-width and
    ligature characters, mojibake, control characters, CJK, RTL, combining marks, emoji sequences,
    "!" (SD2's pad token), special-token look-alikes, long ones (cut to 77), empty ones."""
    import random

    rng = random.Random(seed)
    words = (
        "a photo of the cat dog on in with red blue vintage poster Art canvas print HD 4K women's men's "
        "it's don't I'm we're they've you'll he'd O'Neil rock'n'roll x-ray e-mail 3D 1920s"
    ).split()
    extra = [
        *("café", "naïve", "Zürich", "São Paulo", "Ærø", "straße", "İstanbul", "ΣΟΦΙΑ", "ὈΔΥΣΣΕΎΣ"),
        *("“quoted”", "‘single’", "it’s", "—", "–", "…", "•", "©", "®", "™", "°C", "½", "²", "№"),
        *("東京タワー", "日本語のテキスト", "北京", "한국어 문장", "Москва", "مرحبا بالعالم", "שלום"),
        *("नमस्ते दुनिया", "สวัสดี", "Tiếng Việt", "🙂", "👍🏽", "👨\u200d👩\u200d👧", "🇫🇷", "❤️", "★☆"),
        *(
            "ｆｕｌｌｗｉｄｔｈ",
            "ＡＢＣ１２３",
            "！",
            "？",
            "＆",
            "&amp;",
            "&quot;hi&quot;",
            "&lt;b&gt;",
            "&#39;",
        ),
        *("ﬁne ﬂow", "Ã©", "â€™", "\u00a0nbsp", "zero\u200bwidth", "soft\u00adhyphen", "tab\there"),
        *("new\nline", "cr\r\nlf", "ctrl\x07bell", "\x1b[31mred\x1b[0m", "e\u0301", "A\u030a", "!", "!!"),
        *("wow!", "hi!there", "<|startoftext|>", "<|endoftext|>", "<|ENDOFTEXT|>", "x<|endoftext|>y", "<|"),
        *(
            "|>",
            "<>",
            "$19.99",
            "50%",
            "#hashtag",
            "@user",
            "http://example.com/a?b=c&d=e",
            "C:\\path\\x.jpg",
        ),
        *("a_b_c", "CamelCaseWord", "ALLCAPS", "1234567890", "3.14159", "1/2", "  leading", "trailing  "),
        *("'s", "'''", '"quoted"', "(parens)", "[brackets]", "{braces}"),
    ]
    captions = ["", " ", "!", "a photo of a cat", "word " * 200, "ünïcödé " * 60, "!" * 100, "東京" * 80]
    captions += ["<|startoftext|>", "a!b!c", "A  B\t\tC\n\nD"]
    while len(captions) < n:
        parts = [
            rng.choice(words) if rng.random() < 0.6 else rng.choice(extra) for _ in range(rng.randint(1, 40))
        ]
        captions.append(rng.choice([" ", " ", " ", "", ", "]).join(parts))
    return captions


@pytest.mark.parametrize("pad_token", ["!", "<|endoftext|>"])  # SD2, SD1
@pytest.mark.heavy
def test_saved_tokenizer_loads_back_with_the_same_ids(tmp_path, pad_token):
    """What an exported pipeline carries gives the training ids (transformers 5: one Rust tokenizer),
    for captions that break tokenizers, pickled as a spawned DataLoader worker gets it."""
    tok = build_tokenizer(pad_token=pad_token)
    tok.save_pretrained(tmp_path)
    loaded = CLIPTokenizer.from_pretrained(tmp_path)
    restored = pickle.loads(pickle.dumps(tok))
    assert loaded.pad_token == pad_token and len(loaded) == 49408
    captions = varied_captions()
    ids = tokenize(tok, captions)
    assert ids.dtype == torch.long and ids.shape == (len(captions), MAX_LENGTH)
    assert torch.equal(tokenize(loaded, captions), ids)
    assert torch.equal(tokenize(restored, captions), ids)


@pytest.mark.heavy
def test_ascii_captions_get_open_clips_ids():
    """Without ftfy (transformers 5), captions of printable ASCII without "!" and "&" still get
    open_clip's ids, SD2's own tokenizer."""
    import random
    import string

    from open_clip.tokenizer import SimpleTokenizer

    reference, tok = SimpleTokenizer(), build_tokenizer()
    rng = random.Random(0)
    alphabet = string.printable[:95].replace("&", "").replace("!", "")
    for _ in range(300):
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 60)))
        expected = [reference.sot_token_id, *reference.encode(text)[: MAX_LENGTH - 2], reference.eot_token_id]
        assert tok(text, truncation=True, max_length=MAX_LENGTH).input_ids == expected, repr(text)
