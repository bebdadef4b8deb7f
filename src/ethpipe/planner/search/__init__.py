"""What prunes and steers the search: lower bounds, the search run ahead in a second process, the options."""
