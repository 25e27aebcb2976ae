"""The product's demo (``make demo`` = ``kvflow demo``): the serving engine under memory pressure, driven by the chat
load generator in ``chat.py`` (which ``kvflow bench serve`` measures with too); ``run.py`` runs it."""
