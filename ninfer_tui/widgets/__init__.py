"""Widgets of the chat screen: messages and input (chat.py), the live stats panel (stats.py)."""
