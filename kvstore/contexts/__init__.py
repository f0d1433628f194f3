"""Contexts: sequences named by their token ids, shared by prefix and fork, saved and opened by name.

    sequences.py     Contexts: sequence ids, token ids, content keys (hash chains), fork / prefix sharing
    saving.py        SavedContexts: save, list, delete named contexts beside the cold tier; collect_garbage
    saved_format.py  the saved format: keys, the checksummed manifest, block formats
    opening.py       opening a save lazily
    unread_codes.py  the sketch codes an opened sequence has not read from its save yet
"""
