"""ChatApp's flows, one mixin each (app.py composes them); they share the app's state."""
