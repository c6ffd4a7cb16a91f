from models.tokenizer import MAX_LENGTH, build_tokenizer, tokenize


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
