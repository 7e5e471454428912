"""The backend choice: from settings to an open backend and its profile; `auto` measured on CPU."""
