"""Named studies (conf/experiment/*.yaml) and their driver: `python -m experiments.run study=NAME`."""
