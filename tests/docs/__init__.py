"""README and the documentation site (docs/): the site builds and every page is in its navigation, every Python and
shell block runs as written (or says why not), and the examples they show do what they say."""
