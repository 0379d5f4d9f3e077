"""Images in DataFrames: generate_df's ``image_column`` cells (paths, PIL images or bytes per row) and
``show_images``, an HTML table with thumbnails beside the other columns for Jupyter.

Pure helpers: a cell's check and fingerprint (part of a row's checkpoint key, so a row is reused only for
the same image), the chat content that puts the image before the row's text, and the thumbnail HTML.
"""
from __future__ import annotations

import base64
import hashlib
import html
import io
import os
from typing import Any, Optional

from nbgen.dataframe_rows import RowError, is_missing, require_column

_THUMB_PX = 96


def image_cell(value: Any) -> Optional[Any]:
    """A cell -> the image to send (None for an empty cell); RowError for other types."""
    if value is None:
        return None
    if isinstance(value, (str, os.PathLike, bytes, bytearray)) or _is_pil(value):
        return value
    if _is_na(value):
        return None
    raise RowError(f"image cell must be a path, bytes or a PIL image, got {type(value).__name__}")


def image_cell_or_none(value: Any) -> Optional[Any]:
    """``image_cell`` without the error: None for empty and unusable cells."""
    try:
        return image_cell(value)
    except RowError:
        return None


def _is_na(value: Any) -> bool:
    try:
        return bool(is_missing(value))
    except (TypeError, ValueError):
        return False


def _is_pil(value: Any) -> bool:
    try:
        from PIL import Image
    except ImportError:      # pragma: no cover - pillow is a dependency of the notebook extra
        return False
    return isinstance(value, Image.Image)


def image_fingerprint(value: Any) -> Optional[str]:
    """What identifies a cell's image in the checkpoint key: the path, or a hash of the bytes / pixels."""
    if value is None:
        return None
    if isinstance(value, (str, os.PathLike)):
        return f"path:{os.fspath(value)}"
    if isinstance(value, (bytes, bytearray)):
        return "bytes:" + hashlib.sha256(bytes(value)).hexdigest()[:16]
    digest = hashlib.sha256(value.tobytes())
    digest.update(f"{value.mode}{value.size}".encode())
    return "pil:" + digest.hexdigest()[:16]


def with_image_part(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages whose last user turn starts with an image part (Qwen2-VL's content-list form)."""
    out = [dict(m) for m in messages]
    for m in reversed(out):
        if m.get("role") == "user":
            c = m["content"]
            if isinstance(c, str):
                m["content"] = [{"type": "image"}, {"type": "text", "text": c}]
            elif not any(isinstance(p, dict) and p.get("type") in ("image", "image_url") for p in c):
                m["content"] = [{"type": "image"}] + list(c)
            break
    return out


def thumbnail_html(value: Any, size: int = _THUMB_PX) -> str:
    """An <img> tag with a PNG thumbnail of the cell's image (a short note when it cannot be read)."""
    if image_cell_or_none(value) is None:
        return ""
    from PIL import Image

    try:
        if _is_pil(value):
            img = value.copy()
        else:
            src = io.BytesIO(bytes(value)) if isinstance(value, (bytes, bytearray)) else os.fspath(value)
            img = Image.open(src)
        img = img.convert("RGB")
        img.thumbnail((size, size))
    except Exception as e:   # a missing file or undecodable data stays a visible note, not an error
        return f"<i>unreadable image ({html.escape(type(e).__name__)})</i>"
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    data = base64.b64encode(buf.getvalue()).decode()
    return f'<img src="data:image/png;base64,{data}" style="max-width:{size}px;max-height:{size}px"/>'


class ImageTable:
    """A DataFrame shown as HTML with thumbnails in its image column (Jupyter displays ``_repr_html_``)."""

    def __init__(self, df: Any, image_column: str, size: int) -> None:
        self.df, self.image_column, self.size = df, image_column, size

    def _repr_html_(self) -> str:
        def text(v: Any) -> str:
            return html.escape(str(v)).replace("\n", "<br>")
        formatters = {c: text for c in self.df.columns if c != self.image_column}
        formatters[self.image_column] = lambda v: thumbnail_html(v, self.size)
        return self.df.to_html(formatters=formatters, escape=False)

    def __repr__(self) -> str:
        return repr(self.df)


def show_images(df: Any, image_column: str = "image", size: int = _THUMB_PX) -> ImageTable:
    """``df`` as an HTML table with ``size``-pixel thumbnails of ``image_column`` (paths, bytes or PIL
    images) beside the other columns — e.g. generate_df's output with the captions next to the photos."""
    require_column(df, image_column, "image_column")
    if not isinstance(size, int) or size < 8:
        raise ValueError(f"size must be an int >= 8 (pixels), got {size!r}")
    return ImageTable(df, image_column, size)
