"""Built-in run profiles (YAML). ``ringflow run demo`` loads ``demo.yaml`` from here."""
