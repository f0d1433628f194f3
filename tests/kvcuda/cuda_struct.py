"""The field names of a C struct in a .cu file, in order: what a ctypes mirror of it must list."""

from __future__ import annotations

import re
from pathlib import Path


def struct_fields(source: Path, name: str = "Params") -> list[str]:
    body = re.search(rf"struct {name} \{{(.*?)\}};", source.read_text(), re.S).group(1)
    names = []
    for line in body.splitlines():
        for decl in line.split("//")[0].split(";"):
            decl = decl.strip()
            if decl:
                names += [re.sub(r"^.*[\s*]", "", part.strip()) for part in decl.split(",")]
    return names
