"""Read size, colour mode and completeness of JPEG and PNG files from their bytes, without PIL.

Used by the converter and by the training loader (data/transforms.py: the size of a JPEG before
decoding it). The converter's pass-through path (no resize) writes the original bytes, so it only
needs to know that the file is a whole image it can keep as is. Parsing the few header bytes here
costs a few microseconds where `PIL.Image.open` costs about 50 (the converter's images) to 130 (the
loader's 512x384 photos), which is the difference between the converter keeping up with a plain
MDS writing loop or not. Anything unusual (EXIF, transparency, 16-bit, other codings, a file
that does not end where it should) returns a Header that sends the image to the careful PIL path, and
anything this parser does not understand returns None, which does the same.
"""

from dataclasses import dataclass

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
PNG_END = b"IEND\xaeB`\x82"
# Baseline, extended and progressive Huffman JPEG: what PIL decodes. Other SOF markers (lossless,
# arithmetic, hierarchical) go to PIL, which decides.
JPEG_SOF = {0xC0, 0xC1, 0xC2}
JPEG_OTHER_SOF = {0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}
JPEG_MODES = {1: "L", 3: "RGB", 4: "CMYK"}
# PNG colour type -> the mode PIL decodes it to (8-bit); 16-bit and alpha are flagged separately.
PNG_MODES = {0: "L", 2: "RGB", 3: "P", 4: "LA", 6: "RGBA"}


@dataclass(frozen=True)
class Header:
    format: str  # "JPEG" or "PNG", as PIL names them
    width: int
    height: int
    mode: str
    bits: int  # bits per channel
    complete: bool  # the file ends with its end marker (a cut-off download does not)
    simple: bool  # no EXIF, no transparency, 8-bit: PIL decodes it exactly as the header says

    @property
    def passthrough(self) -> bool:
        """True when the original bytes can be kept: a whole 8-bit RGB, grey or opaque palette image
        without EXIF, which every reader's `convert("RGB")` turns into the right pixels."""
        return self.complete and self.simple and self.mode in ("RGB", "L", "P")


def sniff(data: bytes) -> Header | None:
    if data[:2] == b"\xff\xd8":
        return _jpeg(data)
    if data[:8] == PNG_SIGNATURE:
        return _png(data)
    return None


def _jpeg(data: bytes) -> Header | None:
    n, i, exif = len(data), 2, False
    while i + 4 <= n:
        if data[i] != 0xFF:
            return None
        marker = data[i + 1]
        if marker == 0xFF:  # fill byte
            i += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD8:  # markers without a length
            i += 2
            continue
        length = int.from_bytes(data[i + 2 : i + 4], "big")
        if length < 2:
            return None
        if marker == 0xE1 and data[i + 4 : i + 10] == b"Exif\x00\x00":
            exif = True  # may hold an orientation: PIL reads it
        elif marker in JPEG_SOF:
            if i + 10 > n:
                return None
            precision, components = data[i + 4], data[i + 9]
            height = int.from_bytes(data[i + 5 : i + 7], "big")
            width = int.from_bytes(data[i + 7 : i + 9], "big")
            mode = JPEG_MODES.get(components)
            if precision != 8 or not width or not height or mode is None:
                return None
            complete = data.endswith(b"\xff\xd9")
            return Header("JPEG", width, height, mode, 8, complete, simple=not exif)
        elif marker in JPEG_OTHER_SOF or marker == 0xDA:  # unusual coding, or scan data before a frame
            return None
        i += 2 + length
    return None


def _png(data: bytes) -> Header | None:
    if len(data) < 33 or data[12:16] != b"IHDR":
        return None
    width = int.from_bytes(data[16:20], "big")
    height = int.from_bytes(data[20:24], "big")
    depth, color = data[24], data[25]
    mode = PNG_MODES.get(color)
    if mode is None or not width or not height:
        return None
    simple = depth <= 8
    i = 33  # first chunk after IHDR; walk to the image data looking for transparency and EXIF
    while i + 8 <= len(data):
        length = int.from_bytes(data[i : i + 4], "big")
        kind = data[i + 4 : i + 8]
        if kind == b"IDAT":
            break
        if kind == b"eXIf" or (kind == b"tRNS" and color == 3):
            simple = False
        i += 12 + length
    return Header("PNG", width, height, mode, depth, data.endswith(PNG_END), simple)
